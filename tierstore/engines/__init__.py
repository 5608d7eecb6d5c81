"""Engine adapters: glue between an inference engine's KV cache and a StoreClient.

- ``tierstore.engines.hf``: HuggingFace transformers causal LMs (Llama, Qwen2,
  GPT-2, GPT-NeoX, Falcon, Mistral without sliding window, Phi3, ...; tested
  exact on every tier for Llama, GPT-2 and GPT-NeoX): layout from the model
  config, save after prefill, warm resume, greedy generation.

Adapters run in the engine process and import their engine lazily, so that
``import tierstore`` never pulls in transformers.
"""
