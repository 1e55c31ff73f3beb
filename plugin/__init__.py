"""The node side: discover vfio-bound NVIDIA GPUs and vGPUs and serve them to the kubelet.

Runs as a DaemonSet on GPU nodes; never imports the launcher hook.
"""
