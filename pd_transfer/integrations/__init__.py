"""Engine adapters on top of :mod:`pd_transfer.client`.

Each subpackage translates one engine's memory and request lifecycle into
client calls and tensor views (``sglang/``: an SGLang disaggregation backend
plugin; ``vllm/``: a vLLM KV connector). They hold no transfer logic of their
own, import their engine, and are optional extras: importing
:mod:`pd_transfer` never imports them, and the sidecar never does.
"""
