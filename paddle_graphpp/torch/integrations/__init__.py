"""What the PyTorch front doors know about the libraries they meet, one module per library.

* :mod:`.transformers`: Hugging Face decoder blocks graphed in place (key/value caches,
  attention-weight recording, gradient checkpointing), checked by
  :func:`~paddle_graphpp.torch.layers.graph_layers` and its graphed blocks.
* :mod:`.megatron`: Megatron-Core's CUDA RNG tracker, whose graph-safe generators every capture
  registers (the runtime's hook, :data:`paddle_graphpp.torch.runtime.RNG_TRACKERS`), and its
  ``DistributedDataParallel``'s gradient hooks, which keep ``accumulate_grads="auto"`` off.

None of them imports its library: each reads it from ``sys.modules`` when it is loaded already.
"""
