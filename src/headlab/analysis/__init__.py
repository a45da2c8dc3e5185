"""Head-level analyses that read HeadSites without intervening."""
