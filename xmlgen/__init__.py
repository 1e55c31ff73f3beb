"""xmlgen: the command line to debug the whole path: render, validate, discover, simulate a node.

The one package allowed to compose the device plugin and the launcher hook.
"""
