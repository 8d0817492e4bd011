"""Model configs, loaders, the Llama family and the runner."""
