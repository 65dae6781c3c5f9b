# rules for the eval stages
