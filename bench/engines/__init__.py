"""Real engines through tierstore's connectors, against their own baselines:
vLLM (vllm_kv, with its model and engine-free figures in vllm_paths;
vllm_async), the HF adapter (hf_ttft), SGLang's HiCache (sglang_hicache,
sglang_env.sh) and LMCache beside them (lmcache_server, lmcache_env.sh).
"""
