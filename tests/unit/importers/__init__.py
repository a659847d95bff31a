"""Importer tests: fixtures in each framework's exact on-disk layout."""
