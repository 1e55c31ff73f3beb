// Package v1beta1 declares the one type KubeVirt's informer factory names (see ../../../README.md).
package v1beta1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

var GroupVersion = schema.GroupVersion{Group: "template.kubevirt.io", Version: "v1beta1"}

type VirtualMachineTemplate struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
}

func (t *VirtualMachineTemplate) DeepCopyObject() runtime.Object {
	out := *t
	t.ObjectMeta.DeepCopyInto(&out.ObjectMeta)
	return &out
}
