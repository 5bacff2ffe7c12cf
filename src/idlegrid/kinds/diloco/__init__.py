"""The diloco-train kind: rounds of local training that return compressed pseudo-gradients."""
