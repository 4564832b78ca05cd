"""``engine=vllm``: the vLLM engine, its start-up checks, the decode-stream tap and the shared model
registered in vLLM. Importing this package does not import vLLM; the modules that need it do so inside."""
