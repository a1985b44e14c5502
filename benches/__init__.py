"""The benchmarks behind `mfs bench ...`; shared helpers in benches/lib.py."""
