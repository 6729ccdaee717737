"""The main job: fine-tune a LLaMA-architecture GGUF model (SmolLM2-135M) on text, sharded per parameter.

Modules: ``model`` (the LLaMA decoder), ``gguf_loader`` (weights and config from GGUF), ``tokenizer``
(byte-level BPE from GGUF metadata), ``data`` (text, token rows, per-rank batches), ``train`` (the worker)
and ``cli`` (``perparam finetune``: validation and the local launcher).
"""
