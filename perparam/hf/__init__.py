"""The Hugging Face family: training a perparam-sharded model under ``transformers.Trainer``
(``trainer.ShardedTrainer``) or an ``accelerate.Accelerator`` loop (``accelerator.ShardedAccelerator``),
what both check at their entry (``entry``), and the Hugging Face methods refused on a sharded module
(``methods``). Importing this package imports neither transformers nor accelerate: ``trainer`` and
``accelerator`` do, and are imported by path (their documented paths ``perparam.hf_trainer`` and
``perparam.hf_accelerate`` too). docs/huggingface.md."""
