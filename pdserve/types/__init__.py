"""The shared floor: torch-free types every part of pdserve uses (requests, step records,
engine-core messages, parsed ``kv_transfer_params``, block hashes, configs); it imports no other
part of pdserve.
"""
