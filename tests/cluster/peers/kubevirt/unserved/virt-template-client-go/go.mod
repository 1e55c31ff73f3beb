module kubevirt.io/virt-template-client-go

go 1.26.0

require (
	k8s.io/client-go v0.34.2
)
