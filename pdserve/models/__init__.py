"""Model definitions built from :mod:`pdserve.layers` and :mod:`pdserve.attention`, their
registry and the weight loader."""
