"""The memories: the protocol every memory implements, and the unified cache (cells, placement, defrag).

Implementation modules are private; the public names are re-exported flat from :mod:`kvjax`.
"""
