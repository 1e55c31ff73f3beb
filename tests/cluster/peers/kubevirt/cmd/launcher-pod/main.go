// Command launcher-pod prints the virt-launcher pod KubeVirt's virt-controller would create for a VM, as
// KubeVirt's own code at the pinned kubevirt.io/kubevirt version renders it: the VM controller's
// SetupVMIFromVM, virt-api's defaulting of the VMI, and the template service of pkg/virt-controller/services
// (RenderLaunchManifest), built with the options virt-controller's application.go gives it. The real-cluster
// suite runs this pod (its GPU resource requests, the hook sidecar container from the annotation, its volumes)
// instead of one the project shaped by hand.
//
//	launcher-pod --vm deploy/hook-sidecar/vm-two-gpus.yaml [--namespace gpu-vms] [--kubevirt kubevirt-cr.yaml]
//	             [--launcher-image IMAGE] [--uid UID] [--keep-owner]
//
// One Pod manifest (YAML) on stdout. The pod has generateName (create it, do not apply it), and no
// ownerReferences unless --keep-owner: its owner is a VMI that does not exist in the cluster, and the garbage
// collector deletes a pod whose owner is gone. docs/kubevirt-harness.md, "The launcher pod".
package main

import (
	"flag"
	"fmt"
	"os"
	"strings"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	k8syaml "sigs.k8s.io/yaml"

	v1 "kubevirt.io/api/core/v1"
	"kubevirt.io/client-go/log"

	"kubevirt.io/kubevirt/pkg/defaults"
	"kubevirt.io/kubevirt/pkg/hooks"
	"kubevirt.io/kubevirt/pkg/network/netbinding"
	netannotations "kubevirt.io/kubevirt/pkg/network/pod/annotations"
	netresources "kubevirt.io/kubevirt/pkg/network/resources"
	storageannotations "kubevirt.io/kubevirt/pkg/storage/pod/annotations"
	"kubevirt.io/kubevirt/pkg/testutils"
	"kubevirt.io/kubevirt/pkg/virt-controller/services"
	vmwatch "kubevirt.io/kubevirt/pkg/virt-controller/watch/vm"
)

const maxInputBytes = 1 << 20

// virt-controller's defaults (pkg/virt-controller/watch/application.go), which virt-operator does not change
// but for the images.
const (
	launcherQemuTimeout = 240
	virtShareDir        = "/var/run/kubevirt"
	ephemeralDiskDir    = virtShareDir + "-ephemeral-disks"
	containerDiskDir    = virtShareDir + "/container-disks"
	hotplugDiskDir      = virtShareDir + "/hotplug-disks"
	launcherSubGid      = 107
)

func main() {
	vmPath := flag.String("vm", "", "the VirtualMachine (YAML or JSON)")
	namespace := flag.String("namespace", "", "the VM's namespace (default: its metadata.namespace, else default)")
	kubevirtPath := flag.String("kubevirt", "", "a KubeVirt CR whose spec.configuration is the cluster's (default: "+
		"the Sidecar feature gate only)")
	image := flag.String("launcher-image", "quay.io/kubevirt/virt-launcher:v1.9.0", "virt-launcher's image")
	exporter := flag.String("exporter-image", "quay.io/kubevirt/virt-exportserver:v1.9.0", "the exporter's image")
	uid := flag.String("uid", "6f1b7c1e-0000-4000-8000-000000000002", "the VMI's UID (labels and owner)")
	keepOwner := flag.Bool("keep-owner", false, "keep the pod's ownerReference to the VMI")
	flag.Parse()
	if *vmPath == "" || flag.NArg() > 0 {
		fmt.Fprintln(os.Stderr, "usage: launcher-pod --vm FILE [--namespace NS] [--kubevirt FILE]")
		os.Exit(2)
	}
	log.InitializeLogging("virt-controller")
	out, err := render(*vmPath, *namespace, *kubevirtPath, *image, *exporter, *uid, *keepOwner)
	if err != nil {
		fmt.Fprintf(os.Stderr, "launcher-pod: %v\n", err)
		os.Exit(1)
	}
	os.Stdout.Write(out)
}

func readBounded(path string) ([]byte, error) {
	info, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	if info.Size() > maxInputBytes {
		return nil, fmt.Errorf("%s: larger than %d bytes", path, maxInputBytes)
	}
	return os.ReadFile(path)
}

func clusterConfiguration(path string) (*v1.KubeVirtConfiguration, error) {
	if path == "" {
		return &v1.KubeVirtConfiguration{
			DeveloperConfiguration: &v1.DeveloperConfiguration{FeatureGates: []string{"Sidecar"}},
		}, nil
	}
	data, err := readBounded(path)
	if err != nil {
		return nil, err
	}
	kv := &v1.KubeVirt{}
	if err := k8syaml.UnmarshalStrict(data, kv); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if kv.Kind != "KubeVirt" {
		return nil, fmt.Errorf("%s: kind %q, not KubeVirt", path, kv.Kind)
	}
	return &kv.Spec.Configuration, nil
}

func render(vmPath, namespace, kubevirtPath, image, exporter, uid string, keepOwner bool) ([]byte, error) {
	data, err := readBounded(vmPath)
	if err != nil {
		return nil, err
	}
	vm := &v1.VirtualMachine{}
	if err := k8syaml.UnmarshalStrict(data, vm); err != nil {
		return nil, fmt.Errorf("%s: %w", vmPath, err)
	}
	if vm.Kind != "VirtualMachine" || vm.Spec.Template == nil {
		return nil, fmt.Errorf("%s: not a VirtualMachine with spec.template", vmPath)
	}
	if namespace != "" {
		vm.Namespace = namespace
	}
	if vm.Namespace == "" {
		vm.Namespace = "default"
	}
	if strings.ContainsAny(vm.Namespace+vm.Name, "/\x00") {
		return nil, fmt.Errorf("%s: bad name or namespace", vmPath)
	}
	vm.UID = types.UID(uid + "-vm")

	config, err := clusterConfiguration(kubevirtPath)
	if err != nil {
		return nil, err
	}
	clusterConfig, _, _ := testutils.NewFakeClusterConfigUsingKVConfig(config)

	vmi := vmwatch.SetupVMIFromVM(vm)
	vmi.UID = types.UID(uid)
	if err := defaults.SetDefaultVirtualMachineInstance(clusterConfig, vmi); err != nil {
		return nil, err
	}

	netAnnotationsGenerator := netannotations.NewGenerator(clusterConfig)
	store := func() cache.Store { return cache.NewStore(cache.MetaNamespaceKeyFunc) }
	templateService := services.NewTemplateService(image, launcherQemuTimeout, virtShareDir, ephemeralDiskDir,
		containerDiskDir, hotplugDiskDir, "", store(), nil, clusterConfig, launcherSubGid, exporter, store(),
		store(),
		services.WithSidecarCreator(
			func(vmi *v1.VirtualMachineInstance, _ *v1.KubeVirtConfiguration) (hooks.HookSidecarList, error) {
				return hooks.UnmarshalHookSidecarList(vmi)
			}),
		services.WithSidecarCreator(netbinding.NetBindingPluginSidecarList),
		services.WithNetMemoryCalculator(netresources.MemoryCalculator{}),
		services.WithAnnotationsGenerators(netAnnotationsGenerator, storageannotations.Generator{}),
		services.WithNetTargetAnnotationsGenerator(netAnnotationsGenerator),
	)
	pod, err := templateService.RenderLaunchManifest(vmi)
	if err != nil {
		return nil, err
	}
	pod.APIVersion, pod.Kind = "v1", "Pod"
	pod.Namespace = vmi.Namespace // virt-controller creates it there (its client's namespace, not the manifest)
	if !keepOwner {
		pod.OwnerReferences = nil
	}
	return k8syaml.Marshal(pod)
}
