package main

import (
	_ "kubevirt.io/kubevirt/pkg/virt-controller/services"
)

func main() {}
