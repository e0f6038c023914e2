"""The model: building it on the meta device, torch.export and the graph rewrites, names bound to tensors."""
