"""A real kernel under test (issue 13): a throwaway QEMU guest node with an IOMMU, real vfio-pci and mdevs.

``assets`` downloads (``apt-get download`` + ``dpkg -x``, cached outside the repository, keyed by package
version) Debian's kernel, its headers, kbuild, ``linux-source-6.1`` and ``busybox-static``, builds the mdev
sample modules and an initramfs. ``guest`` boots a guest with a chosen device set and runs a command inside
it, the host's root mounted read-only over 9p, and returns its exit status and files. ``python -m
tests.realnode`` is the same from the shell (``scripts/realnode.sh``). See docs/real-kernel.md.
"""
