"""Fuzzing segcli's readers with atheris: targets (fuzz.targets), seed corpora (fuzz.seed) and
the runner (fuzz.run). See fuzz/README.md."""
