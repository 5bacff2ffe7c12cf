# Build the worker for Windows with PyInstaller, from the repository's virtual environment:
#   powershell -ExecutionPolicy Bypass -File scripts\build-worker-binary.ps1 [-WithMl]
# makes dist\idlegrid-worker.exe (`idlegrid worker`, a console program) and
# dist\idlegrid-worker-tray.exe (the tray, no console window). The recipe is
# packaging\build_worker.py with packaging\idlegrid-worker.spec.
param([switch]$WithMl)
$ErrorActionPreference = "Stop"
Set-Location (Join-Path $PSScriptRoot "..")
$python = if ($env:PYTHON) { $env:PYTHON } else { ".venv\Scripts\python.exe" }
& $python -m PyInstaller --version *> $null
if ($LASTEXITCODE -ne 0) {
    & $python -m pip install --quiet "pyinstaller>=6.11,<7"
    if ($LASTEXITCODE -ne 0) { exit $LASTEXITCODE }
}
$arguments = @("packaging\build_worker.py")
if ($WithMl) { $arguments += "--with-ml" }
& $python @arguments
if ($LASTEXITCODE -ne 0) { exit $LASTEXITCODE }
& dist\idlegrid-worker.exe --help | Select-Object -First 3
