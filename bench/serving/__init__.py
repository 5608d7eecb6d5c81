"""vLLM's OpenAI server under a multi-turn chat load with and without KV
stores (vllm_serve) and its servers (engine); the load itself is
harness.chat_load. Sessions moving between engines are bench.fleet's.
"""
