"""Cluster-level simulation of training on spot nodes, and trace replay."""
