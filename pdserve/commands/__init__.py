"""The command line's parts: the shared argument parser and ``pdserve chat``.
"""
