"""Speculative decoding with the MTP module (issue #42); see runner.py."""
