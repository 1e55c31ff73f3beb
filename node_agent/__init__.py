"""The node agent (``gpu-node-agent``): prepares a node for GPU VMs (docs/node-agent.md).

``bind``/``unbind`` move each selected GPU and every other function of its IOMMU group onto (or off) the VFIO
driver; ``vgpu apply`` creates the vGPUs a vgpu-device-manager style config asks for (mdev parents and SR-IOV
vGPU VFs), changing only the difference; ``validate`` says whether the node is ready for its workload.
Every write to the kernel goes through a :class:`~node_agent.kernel.Kernel` (the real one writes sysfs
files; tests use ``simkit.kernel_sim``, which gives each write the kernel's effect on a fixture tree).
"""
