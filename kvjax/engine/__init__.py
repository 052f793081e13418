"""The decode driver (the seed's ``llama_decode``), generation and token sampling.

Implementation modules are private; the public names are re-exported flat from :mod:`kvjax`.
"""
