//go:build tools

// Package tools records the main package built from this module so that
// 'go mod tidy' keeps its dependencies in go.mod/go.sum.
package tools

import (
	_ "sigs.k8s.io/kueue/cmd/kueue"
)
