"""Input and output: the seed's state byte format, session files, orbax checkpoints.

Implementation modules are private; the public names are re-exported flat from :mod:`kvjax`.
"""

# Every memory's state format is registered by the module that defines it (the memories never
# import their codecs); importing the package registers them all.
from kvjax.io import _composite_state, _recurrent_state, _state, _streams_state  # noqa: F401
