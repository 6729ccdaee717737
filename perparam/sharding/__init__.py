"""The pure floor: what each rank holds, computed without processes (placements, layouts, quantizers,
policies, one parameter's resolution). Imports no process-group API and allocates no tensor at import;
``perparam plan`` and ``perparam.memory`` use it without starting a process."""
