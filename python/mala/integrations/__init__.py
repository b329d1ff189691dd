"""Integrations with other libraries (imported on demand): mala.integrations.transformers."""
