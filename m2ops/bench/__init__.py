"""Side-by-side benchmarks of m2ops against mamba_ssm and TileGym: python -m m2ops.bench --help."""
