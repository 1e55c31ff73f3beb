// Package core declares the names KubeVirt's pkg/controller takes from kubevirt.io/virt-template-api/core,
// which the Go module proxy does not serve (see ../../README.md).
package core

const (
	GroupName                   = "template.kubevirt.io"
	SingularResourceName        = "virtualmachinetemplate"
	PluralResourceName          = "virtualmachinetemplates"
	SingularRequestResourceName = "virtualmachinetemplaterequest"
)
