"""The error a wrong configuration raises, in a module of its own so that the light helpers that name
config values (spmdrl.imports, spmdrl.registry) and each package's config section raise it without
importing spmdrl.config, which sits above them (it composes the sections). spmdrl.config re-exports it."""


class ConfigError(ValueError):
    """A configuration value is wrong. The message says which key, what is wrong and how to fix it."""
