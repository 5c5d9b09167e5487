"""Version numbers of the core and of the plugin API it speaks."""

__version__ = "0.1.0"

#: The plugin API this core implements. A plugin states the API version it was built for; the core
#: loads plugins of the same major version and refuses others with a :class:`hal.PluginError`.
API_VERSION = "1.0"
