"""Serving-engine integrations. Each submodule imports its engine; import only the one
you run (``p2pkv.integrations.vllm`` needs vLLM installed)."""
