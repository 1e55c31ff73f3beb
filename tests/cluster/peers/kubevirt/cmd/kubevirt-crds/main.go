// Command kubevirt-crds prints the CustomResourceDefinitions KubeVirt's operator installs, as KubeVirt's own
// code (virt-operator's components package, at the pinned kubevirt.io/kubevirt version) makes them: the
// cluster kit applies them so that the VirtualMachine and KubeVirt objects in deploy/ are checked by
// KubeVirt's OpenAPI schema, not only by the project's reading of it.
package main

import (
	"fmt"
	"os"

	extv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"sigs.k8s.io/yaml"

	"kubevirt.io/kubevirt/pkg/virt-operator/resource/generate/components"
)

func main() {
	makers := []func() (*extv1.CustomResourceDefinition, error){
		components.NewKubeVirtCrd,
		components.NewVirtualMachineCrd,
		components.NewVirtualMachineInstanceCrd,
		components.NewPresetCrd,
		components.NewReplicaSetCrd,
		components.NewVirtualMachineInstanceMigrationCrd,
		components.NewVirtualMachinePoolCrd,
		components.NewVirtualMachineInstancetypeCrd,
		components.NewVirtualMachineClusterInstancetypeCrd,
		components.NewVirtualMachinePreferenceCrd,
		components.NewVirtualMachineClusterPreferenceCrd,
		components.NewMigrationPolicyCrd,
		components.NewPluginCrd,
	}
	for _, make := range makers {
		crd, err := make()
		if err != nil {
			fmt.Fprintf(os.Stderr, "kubevirt-crds: %v\n", err)
			os.Exit(1)
		}
		out, err := yaml.Marshal(crd)
		if err != nil {
			fmt.Fprintf(os.Stderr, "kubevirt-crds: %s: %v\n", crd.Name, err)
			os.Exit(1)
		}
		fmt.Printf("---\n%s", out)
	}
}
