"""Lightning modules, data modules and callbacks."""
