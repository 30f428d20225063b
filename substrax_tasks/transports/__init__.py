"""How files move between here and the machine that runs a step."""
