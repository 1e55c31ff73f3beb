"""The DRA kubelet plugin (issue 16): registration, NodePrepareResources/NodeUnprepareResources, CDI specs.

A pure prepare core (:mod:`plugin.dra.prepare`) over the same discovery as the device plugin, thin gRPC
servicers (:mod:`plugin.dra.service`), and the seams the cluster side plugs into: where a claim's allocation
comes from (:mod:`plugin.dra.claims`) and who publishes ResourceSlices for each inventory. docs/dra.md.
"""
