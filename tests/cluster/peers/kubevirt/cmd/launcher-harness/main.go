// Command launcher-harness runs virt-launcher's own domain sequence, KubeVirt's code at the pinned
// kubevirt.io/kubevirt version, for one VMI against the project's hook, and prints what happened as JSON.
//
// The sequence is SyncVMI's up to the domain's start, which it never reaches: virt-api's defaulting
// (pkg/defaults), the LibvirtDomainManager's converter context (the hostdevice/gpu/generic/DRA code reading
// the allocation env and the KEP-5304 metadata files), the converter and the domain defaulter, then
// allocateHotplugPorts, which on q35 defines the domain up to three times through SetDomainSpecStrWithHooks
// (the hook sidecar API's pkg/hooks manager, then the plugin pipeline), each time from its own earlier output
// read back through api.DomainSpec; then buildDevicesMetadata on the defined domain. Every define goes to a
// real libvirtd (qemu:///system by default); the domain is undefined at the end.
//
// KubeVirt's fixed paths (/var/run/kubevirt-hooks, /var/run/kubevirt-plugin, the DRA metadata root) are
// bind-mounted from the directories given, in a private mount namespace the command enters by re-executing
// itself under unshare(1): nothing of the host's is changed but the empty mount points. What needs a live
// node is stubbed (docs/kubevirt-harness.md lists each stub).
package main

import (
	"encoding/json"
	"encoding/xml"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"time"
	_ "unsafe" // go:linkname

	"libvirt.org/go/libvirt"
	k8syaml "sigs.k8s.io/yaml"

	v1 "kubevirt.io/api/core/v1"
	pluginv1alpha1 "kubevirt.io/api/plugin/v1alpha1"
	"kubevirt.io/client-go/log"

	cloudinit "kubevirt.io/kubevirt/pkg/cloud-init"
	containerdisk "kubevirt.io/kubevirt/pkg/container-disk"
	"kubevirt.io/kubevirt/pkg/defaults"
	ephemeraldisk "kubevirt.io/kubevirt/pkg/ephemeral-disk"
	cmdv1 "kubevirt.io/kubevirt/pkg/handler-launcher-com/cmd/v1"
	"kubevirt.io/kubevirt/pkg/hooks"
	"kubevirt.io/kubevirt/pkg/network/domainspec"
	"kubevirt.io/kubevirt/pkg/testutils"
	"kubevirt.io/kubevirt/pkg/util/hardware"
	virtconfig "kubevirt.io/kubevirt/pkg/virt-config"
	vmwatch "kubevirt.io/kubevirt/pkg/virt-controller/watch/vm"
	"kubevirt.io/kubevirt/pkg/virt-launcher/metadata"
	"kubevirt.io/kubevirt/pkg/virt-launcher/virtwrap"
	"kubevirt.io/kubevirt/pkg/virt-launcher/virtwrap/api"
	"kubevirt.io/kubevirt/pkg/virt-launcher/virtwrap/cli"
	"kubevirt.io/kubevirt/pkg/virt-launcher/virtwrap/converter"
	convertertypes "kubevirt.io/kubevirt/pkg/virt-launcher/virtwrap/converter/types"
	"kubevirt.io/kubevirt/pkg/virt-launcher/virtwrap/plugins"
	"kubevirt.io/kubevirt/pkg/virt-launcher/virtwrap/util"
)

// KubeVirt's own unexported steps, called as they are (no copy): SyncVMI's converter context, the hotplug
// port allocation that defines the domain, and the device metadata built from the defined domain. And the
// seam through which virt-launcher's util package reaches the hook manager, wrapped to record each call.

//go:linkname generateConverterContext kubevirt.io/kubevirt/pkg/virt-launcher/virtwrap.(*LibvirtDomainManager).generateConverterContext
func generateConverterContext(l *virtwrap.LibvirtDomainManager, vmi *v1.VirtualMachineInstance, allowEmulation bool, options *cmdv1.VirtualMachineOptions, isMigrationTarget bool) (*convertertypes.ConverterContext, error)

//go:linkname allocateHotplugPorts kubevirt.io/kubevirt/pkg/virt-launcher/virtwrap.(*LibvirtDomainManager).allocateHotplugPorts
func allocateHotplugPorts(l *virtwrap.LibvirtDomainManager, vmi *v1.VirtualMachineInstance, domainSpec *api.DomainSpec) (cli.VirDomain, error)

//go:linkname buildDevicesMetadata kubevirt.io/kubevirt/pkg/virt-launcher/virtwrap.(*LibvirtDomainManager).buildDevicesMetadata
func buildDevicesMetadata(l *virtwrap.LibvirtDomainManager, vmi *v1.VirtualMachineInstance, dom cli.VirDomain) ([]cloudinit.DeviceData, error)

//go:linkname getHookManager kubevirt.io/kubevirt/pkg/virt-launcher/virtwrap/util.getHookManager
var getHookManager func() hooks.Manager

const (
	hooksDir      = hooks.HookSocketsSharedDirectory               // /var/run/kubevirt-hooks
	pluginsDir    = "/var/run/kubevirt-plugin"                     // plugins' sidecar.go: pluginSocketBaseDir
	draDir        = "/var/run/kubernetes.io/dra-device-attributes" // pkg/dra: DefaultMetadataBasePath
	inNamespace   = "KGP_LAUNCHER_HARNESS_NS"
	maxInputBytes = 4 << 20
)

// HookCall is one OnDefineDomain through KubeVirt's hook manager: the spec it was given (as the manager
// marshals it) and the XML the hook sidecars returned.
type HookCall struct {
	Input  string `json:"input"`
	Output string `json:"output,omitempty"`
	Error  string `json:"error,omitempty"`
}

// Define is one DomainDefineXML virt-launcher made: the XML it sent and libvirt's inactive XML after it.
type Define struct {
	XML      string `json:"xml"`
	Inactive string `json:"inactive,omitempty"`
	Adapted  string `json:"adapted,omitempty"`
	Error    string `json:"error,omitempty"`
}

// Result is what the command prints.
type Result struct {
	Domain          string                 `json:"domain"`
	DomainType      string                 `json:"domainType,omitempty"`
	Converted       string                 `json:"converted,omitempty"`
	HookCalls       []HookCall             `json:"hookCalls"`
	Defines         []Define               `json:"defines"`
	Final           string                 `json:"final,omitempty"`
	ReadBack        string                 `json:"readBack,omitempty"`
	DevicesMetadata []cloudinit.DeviceData `json:"devicesMetadata"`
	Stage           string                 `json:"stage"`
	Error           string                 `json:"error,omitempty"`
}

type recordingManager struct {
	hooks.Manager
	calls *[]HookCall
}

func (m recordingManager) OnDefineDomain(spec *api.DomainSpec, vmi *v1.VirtualMachineInstance) (string, error) {
	input, _ := xml.MarshalIndent(spec, "", "\t")
	output, err := m.Manager.OnDefineDomain(spec, vmi)
	call := HookCall{Input: string(input), Output: output}
	if err != nil {
		call.Error = err.Error()
	}
	*m.calls = append(*m.calls, call)
	return output, err
}

type recordingConnection struct {
	cli.Connection
	defines        *[]Define
	libvirtVersion uint32
}

// slotlessMaxMemory is the <maxMemory> KubeVirt writes for memory hotplug (virtio-mem): it never sets
// api.MaxMemory.Slots, so slots="0" (or, through the plugin pipeline's libvirtxml, no slots at all). libvirt 9.0
// refuses that ("both maximum memory size and memory slot count must be specified"); the libvirt KubeVirt ships
// accepts it. On a libvirt older than 10 the element is dropped before the define (the VM then has no memory
// hotplug, which nothing here looks at); docs/kubevirt-harness.md.
var slotlessMaxMemory = regexp.MustCompile(`\s*<maxMemory unit="b"(?: slots="0")?>[0-9]+</maxMemory>`)

func (c recordingConnection) DomainDefineXML(domainXML string) (cli.VirDomain, error) {
	define := Define{XML: domainXML}
	if c.libvirtVersion < 10_000_000 && slotlessMaxMemory.MatchString(domainXML) {
		domainXML = slotlessMaxMemory.ReplaceAllString(domainXML, "")
		define.Adapted = "maxMemory slots=0 dropped (libvirt < 10)"
	}
	dom, err := c.Connection.DomainDefineXML(domainXML)
	if err != nil {
		define.Error = err.Error()
	} else if inactive, xmlErr := dom.GetXMLDesc(libvirt.DOMAIN_XML_INACTIVE); xmlErr == nil {
		define.Inactive = inactive
	} else {
		define.Error = xmlErr.Error()
	}
	*c.defines = append(*c.defines, define)
	return dom, err
}

type options struct {
	vmi, envFile, out, uri                     string
	hooks, plugins, dra, pciSysfs, ovmf, disks string
	plugin, pluginSocket                       string
	sidecars                                   uint
	featureGates                               string
	pciNUMAAware, keep                         bool
	topology, cpuset                           string
	collectTimeout                             time.Duration
}

func main() {
	var o options
	flag.StringVar(&o.vmi, "vmi", "", "the VMI (JSON or YAML; of a VirtualMachine, the VMI its controller makes)")
	flag.StringVar(&o.envFile, "env-file", "", "KEY=VALUE lines: the compute container's allocation env")
	flag.StringVar(&o.out, "out", "", "write the JSON result here (default: stdout)")
	flag.StringVar(&o.uri, "uri", "qemu:///system", "libvirt URI the domain is defined on")
	flag.StringVar(&o.hooks, "hooks-dir", "", "bound onto "+hooksDir+" (holds <container>/<socket>)")
	flag.UintVar(&o.sidecars, "sidecars", 0, "hook sidecars to collect (the hooks annotation's entries)")
	flag.DurationVar(&o.collectTimeout, "collect-timeout", 60*time.Second, "how long Collect waits")
	flag.StringVar(&o.plugins, "plugins-dir", "", "bound onto "+pluginsDir)
	flag.StringVar(&o.plugin, "plugin", "", "a Plugin CR's name: run the plugin pipeline with one sidecar domain hook")
	flag.StringVar(&o.pluginSocket, "plugin-socket", "", "the Plugin's domainHooks[0].sidecar.socketPath")
	flag.StringVar(&o.dra, "dra-dir", "", "bound onto "+draDir+" (KEP-5304 metadata files)")
	flag.StringVar(&o.pciSysfs, "pci-sysfs", "", "stand-in for /sys/bus/pci/devices (numa_node files)")
	flag.StringVar(&o.ovmf, "ovmf", "", "OVMF directory (EFI VMs)")
	flag.StringVar(&o.disks, "container-disks", "", "directory for the container disks' images (made here)")
	flag.StringVar(&o.featureGates, "feature-gates", "", "comma-separated KubeVirt feature gates")
	flag.BoolVar(&o.pciNUMAAware, "pci-numa-aware", false, "virt-handler's PCINUMAAwareTopologyEnabled")
	flag.BoolVar(&o.keep, "keep", false, "leave the domain defined")
	flag.StringVar(&o.topology, "topology", "", "virt-handler's node topology (cmdv1.Topology as JSON)")
	flag.StringVar(&o.cpuset, "cpuset", "0,1", "the pod's cpuset (comma-separated CPU numbers)")
	flag.Parse()
	if o.vmi == "" || o.disks == "" {
		fmt.Fprintln(os.Stderr, "launcher-harness: --vmi and --container-disks are required")
		os.Exit(2)
	}

	if os.Getenv(inNamespace) == "" {
		os.Exit(reexecInNamespace())
	}
	result := &Result{HookCalls: []HookCall{}, Defines: []Define{}, DevicesMetadata: []cloudinit.DeviceData{}}
	err := run(o, result)
	if err != nil {
		result.Error = err.Error()
	}
	out, _ := json.MarshalIndent(result, "", "  ")
	if o.out != "" {
		if writeErr := os.WriteFile(o.out, out, 0o600); writeErr != nil {
			fmt.Fprintf(os.Stderr, "launcher-harness: %v\n", writeErr)
			os.Exit(2)
		}
	} else {
		os.Stdout.Write(append(out, '\n'))
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "launcher-harness: %s: %v\n", result.Stage, err)
		os.Exit(1)
	}
}

// reexecInNamespace runs this command again in a private mount namespace (unshare(1): Go cannot unshare
// CLONE_NEWNS once it has threads), where KubeVirt's fixed paths can be bind-mounted.
func reexecInNamespace() int {
	self, err := os.Executable()
	if err != nil {
		fmt.Fprintf(os.Stderr, "launcher-harness: %v\n", err)
		return 2
	}
	cmd := exec.Command("unshare", append([]string{"--mount", "--propagation", "private", self}, os.Args[1:]...)...)
	cmd.Env = append(os.Environ(), inNamespace+"=1")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = nil, os.Stdout, os.Stderr
	if err := cmd.Run(); err != nil {
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			return exit.ExitCode()
		}
		fmt.Fprintf(os.Stderr, "launcher-harness: unshare: %v\n", err)
		return 2
	}
	return 0
}

func bind(source, target string) error {
	if source == "" {
		return nil
	}
	info, err := os.Stat(source)
	if err != nil || !info.IsDir() {
		return fmt.Errorf("%s: not a directory (%v)", source, err)
	}
	if err := os.MkdirAll(target, 0o755); err != nil {
		return err
	}
	if err := syscall.Mount(source, target, "", syscall.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind %s on %s: %w", source, target, err)
	}
	return nil
}

func readVMI(path string) (*v1.VirtualMachineInstance, error) {
	data, err := readBounded(path)
	if err != nil {
		return nil, err
	}
	var probe struct {
		Kind string `json:"kind"`
	}
	if err := k8syaml.Unmarshal(data, &probe); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	vmi := &v1.VirtualMachineInstance{}
	if probe.Kind == "VirtualMachine" {
		vm := &v1.VirtualMachine{}
		if err := k8syaml.UnmarshalStrict(data, vm); err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		if vm.Spec.Template == nil {
			return nil, fmt.Errorf("%s: VirtualMachine without spec.template", path)
		}
		if vm.Namespace == "" {
			vm.Namespace = "default"
		}
		vmi = vmwatch.SetupVMIFromVM(vm) // the VM controller's own VMI for it
	} else if err := k8syaml.UnmarshalStrict(data, vmi); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	vmi.APIVersion, vmi.Kind = v1.GroupVersion.String(), "VirtualMachineInstance"
	if vmi.Namespace == "" {
		vmi.Namespace = "default"
	}
	if vmi.UID == "" {
		vmi.UID = "6f1b7c1e-0000-4000-8000-000000000001"
	}
	return vmi, nil
}

func readBounded(path string) ([]byte, error) {
	file, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer file.Close()
	data, err := io.ReadAll(io.LimitReader(file, maxInputBytes+1))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if len(data) > maxInputBytes {
		return nil, fmt.Errorf("%s: larger than %d bytes", path, maxInputBytes)
	}
	return data, nil
}

// setEnv puts the allocation env into this process, as the kubelet put it into the compute container.
func setEnv(path string) error {
	if path == "" {
		return nil
	}
	data, err := readBounded(path)
	if err != nil {
		return err
	}
	for number, line := range strings.Split(strings.ReplaceAll(string(data), "\x00", "\n"), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		key, value, ok := strings.Cut(line, "=")
		if !ok || key == "" {
			return fmt.Errorf("%s:%d: not KEY=VALUE", path, number+1)
		}
		if err := os.Setenv(key, value); err != nil {
			return err
		}
	}
	return nil
}

// makeContainerDisks writes a small qcow2 for each containerDisk volume where virt-launcher reads its
// image info (the stand-in for the container-disk image a node would have pulled).
func makeContainerDisks(vmi *v1.VirtualMachineInstance, dir string) error {
	containerdisk.SetLocalDirectoryOnly(dir)
	for index, volume := range vmi.Spec.Volumes {
		if volume.ContainerDisk == nil {
			continue
		}
		path := containerdisk.GetDiskTargetPathFromLauncherView(index)
		if filepath.Dir(path) != filepath.Clean(dir) {
			return fmt.Errorf("container disk %s: %s is outside %s", volume.Name, path, dir)
		}
		out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", path, "16M").CombinedOutput()
		if err != nil {
			return fmt.Errorf("qemu-img create %s: %v: %s", path, err, out)
		}
	}
	return nil
}

func run(o options, result *Result) error {
	log.InitializeLogging("virt-launcher")
	result.Stage = "setup"
	for _, mount := range [][2]string{{o.hooks, hooksDir}, {o.plugins, pluginsDir}, {o.dra, draDir}} {
		if err := bind(mount[0], mount[1]); err != nil {
			return err
		}
	}
	if o.pciSysfs != "" {
		hardware.PciBasePath = o.pciSysfs
	}
	if err := setEnv(o.envFile); err != nil {
		return err
	}
	vmi, err := readVMI(o.vmi)
	if err != nil {
		return err
	}

	result.Stage = "defaults"
	kvConfig := &v1.KubeVirtConfiguration{DeveloperConfiguration: &v1.DeveloperConfiguration{}}
	if o.featureGates != "" {
		kvConfig.DeveloperConfiguration.FeatureGates = strings.Split(o.featureGates, ",")
	}
	clusterConfig, _, _ := testutils.NewFakeClusterConfigUsingKVConfig(kvConfig)
	if err := defaults.SetDefaultVirtualMachineInstance(clusterConfig, vmi); err != nil {
		return err
	}
	if err := makeContainerDisks(vmi, o.disks); err != nil {
		return err
	}

	result.Stage = "hooks"
	manager := hooks.GetManager()
	if o.sidecars > 0 {
		if err := manager.Collect(o.sidecars, o.collectTimeout); err != nil {
			return err
		}
	}
	getHookManager = func() hooks.Manager { return recordingManager{manager, &result.HookCalls} }
	if o.plugin != "" {
		plugins.SetPlugins([]pluginv1alpha1.Plugin{pluginCR(o.plugin, o.pluginSocket)})
	}

	cpus, err := parseCPUSet(o.cpuset)
	if err != nil {
		return err
	}
	result.Stage = "libvirt"
	connection, err := cli.NewConnection(o.uri, "", "", 10*time.Second)
	if err != nil {
		return err
	}
	defer connection.Close()
	version, err := libvirt.GetVersion()
	if err != nil {
		return err
	}
	recording := recordingConnection{connection, &result.Defines, version}
	stop := make(chan struct{})
	defer close(stop)
	domainManager, err := virtwrap.NewLibvirtDomainManager(recording, "/nonexistent/virt-share",
		"/nonexistent/ephemeral-disks", nil, o.ovmf,
		ephemeraldisk.NewEphemeralDiskCreator(filepath.Join(o.disks, "ephemeral")), metadata.NewCache(), stop,
		virtconfig.DefaultDiskVerificationMemoryLimitBytes,
		func() ([]int, error) { return cpus, nil }, false, false, nil, v1.KvmHypervisorName, nil, "", false,
		false, false)
	if err != nil {
		return err
	}
	l, ok := domainManager.(*virtwrap.LibvirtDomainManager)
	if !ok {
		return fmt.Errorf("NewLibvirtDomainManager returned %T", domainManager)
	}

	result.Stage = "convert"
	vmOptions := &cmdv1.VirtualMachineOptions{
		ClusterConfig: &cmdv1.ClusterConfig{PCINUMAAwareTopologyEnabled: o.pciNUMAAware},
		// as virt-handler fills it in (pkg/virt-handler/vm.go)
		InterfaceDomainAttachment: domainspec.DomainAttachmentByInterfaceName(vmi.Spec.Domain.Devices.Interfaces,
			clusterConfig.GetNetworkBindings()),
	}
	if o.topology != "" {
		data, err := readBounded(o.topology)
		if err != nil {
			return err
		}
		vmOptions.Topology = &cmdv1.Topology{}
		if err := json.Unmarshal(data, vmOptions.Topology); err != nil {
			return fmt.Errorf("%s: %w", o.topology, err)
		}
	}
	c, err := generateConverterContext(l, vmi, true, vmOptions, false)
	if err != nil {
		return err
	}
	domain := &api.Domain{}
	if err := converter.Convert_v1_VirtualMachineInstance_To_api_Domain(vmi, domain, c); err != nil {
		return err
	}
	api.NewDefaulter(c.Architecture.GetArchitecture()).SetObjectDefaults_Domain(domain)
	result.Domain, result.DomainType = domain.Spec.Name, domain.Spec.Type
	converted, _ := xml.MarshalIndent(domain.Spec, "", "\t")
	result.Converted = string(converted)

	result.Stage = "define"
	dom, err := allocateHotplugPorts(l, vmi, &domain.Spec)
	if err != nil {
		undefine(connection, domain.Spec.Name, o.keep)
		return err
	}
	defer dom.Free()
	defer undefine(connection, domain.Spec.Name, o.keep)
	if result.Final, err = dom.GetXMLDesc(libvirt.DOMAIN_XML_INACTIVE); err != nil {
		return err
	}
	readBack, err := util.GetDomainSpecWithFlags(dom, libvirt.DOMAIN_XML_INACTIVE)
	if err != nil {
		return err
	}
	readBackXML, _ := xml.MarshalIndent(readBack, "", "\t")
	result.ReadBack = string(readBackXML)

	result.Stage = "metadata"
	devicesMetadata, err := buildDevicesMetadata(l, vmi, dom)
	if err != nil {
		return err
	}
	if devicesMetadata != nil {
		result.DevicesMetadata = devicesMetadata
	}
	result.Stage = "done"
	return nil
}

func parseCPUSet(text string) ([]int, error) {
	var cpus []int
	for _, field := range strings.Split(text, ",") {
		cpu, err := strconv.Atoi(strings.TrimSpace(field))
		if err != nil || cpu < 0 || cpu > 4095 {
			return nil, fmt.Errorf("--cpuset %q: %q is not a CPU number", text, field)
		}
		cpus = append(cpus, cpu)
	}
	return cpus, nil
}

func pluginCR(name, socket string) pluginv1alpha1.Plugin {
	plugin := pluginv1alpha1.Plugin{}
	plugin.Name = name
	plugin.Spec.DomainHooks = []pluginv1alpha1.DomainHook{{Sidecar: &pluginv1alpha1.SidecarDomainHook{SocketPath: socket}}}
	return plugin
}

func undefine(connection cli.Connection, name string, keep bool) {
	if keep || name == "" {
		return
	}
	dom, err := connection.LookupDomainByName(name)
	if err != nil {
		return
	}
	defer dom.Free()
	_ = dom.UndefineFlags(libvirt.DOMAIN_UNDEFINE_NVRAM)
}
