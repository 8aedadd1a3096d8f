"""The model runner (one engine step on the model), its CUDA-graph helper and the sampler."""
