"""The error a wrong configuration raises, in a module of its own so that the light helpers that name
config values (spmdrl.imports, spmdrl.registry) raise it without importing spmdrl.config, which imports
spmdrl.algos' registries lazily (an import cycle otherwise). spmdrl.config re-exports it."""


class ConfigError(ValueError):
    """A configuration value is wrong. The message says which key, what is wrong and how to fix it."""
