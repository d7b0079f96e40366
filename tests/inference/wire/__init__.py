"""Tests of the wire contracts between router and workers."""
