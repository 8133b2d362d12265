"""What each CLI verb does, as library calls: discover -> plan -> act -> record."""
