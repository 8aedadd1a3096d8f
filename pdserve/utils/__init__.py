"""Process-level helpers every part may use: the phase trace and the garbage-collector set-up.
"""
