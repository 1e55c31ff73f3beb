// Package virttemplate declares the client names KubeVirt's informer factory takes (see ../../README.md).
package virttemplate

import (
	"k8s.io/client-go/rest"
)

type TemplateV1beta1Interface interface {
	RESTClient() rest.Interface
}

type Interface interface {
	TemplateV1beta1() TemplateV1beta1Interface
}

type Clientset struct{ client rest.Interface }

func (c *Clientset) TemplateV1beta1() TemplateV1beta1Interface { return c }

func (c *Clientset) RESTClient() rest.Interface { return c.client }

func NewForConfig(c *rest.Config) (*Clientset, error) {
	client, err := rest.RESTClientFor(c)
	if err != nil {
		return nil, err
	}
	return &Clientset{client: client}, nil
}
