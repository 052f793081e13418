"""Input and output: the seed's state byte format, session files, orbax checkpoints.

Implementation modules are private; the public names are re-exported flat from :mod:`kvjax`.
"""
