"""vLLM's OpenAI server under a multi-turn chat load with and without KV
stores (vllm_serve), its servers (engine) and two-engine modes (two); the load
itself is harness.chat_load.
"""
