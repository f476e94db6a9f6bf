"""megatron-core / Megatron-LM integration: install/uninstall, version adapter, arguments."""
