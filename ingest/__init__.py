"""Getting AI-READI OCT into shape: mirror, DICOM decode and validation, normalisation."""
