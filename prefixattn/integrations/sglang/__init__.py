"""SGLang integration: the ``prefixattn`` attention backend and prefix-group schedule policies, as an SGLang plugin.

Importing this package never imports sglang; :func:`prefixattn.integrations.sglang.plugin.load` (SGLang's entry point)
does, and the backend module is imported only when SGLang builds the backend. Supported: sglang==0.5.23 only.
"""
